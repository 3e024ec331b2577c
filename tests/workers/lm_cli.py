"""``python -m mlx_fsdp.lora`` as a script path, for tests/launch.py's launchers."""

import runpy

runpy.run_module("mlx_fsdp.lora", run_name="__main__", alter_sys=True)
