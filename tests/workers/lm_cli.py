"""``python -m mlx_fsdp.lora`` as a script, for tests/launch.py's launchers.

Usage: ``lm_cli.py FLAGS [--- FLAGS ...]``: one run per group of flags, one
after the other in this process (one launch for several runs).
"""

import sys

from lm_common import split_runs

from mlx_fsdp.lora import main

for flags in split_runs(sys.argv[1:]):
    main(flags)
