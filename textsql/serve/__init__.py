"""Servers bound to 127.0.0.1: TensorBoard on the runs root (tensorboard) and JupyterLab on the notebooks (lab)."""
