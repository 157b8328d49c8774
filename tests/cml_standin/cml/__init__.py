"""Test stand-in for CML's `cml` package (the real one exists only inside a CML session)."""
