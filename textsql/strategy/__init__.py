"""How a run is spread over devices: the table of strategies (table), DeepSpeed configs (dsconfig, dsconfig_rules) and
the CPU/GPU and precision decisions (devices), DeepSpeed's op builds (opbuilds)."""
