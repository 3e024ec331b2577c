"""The reference of tests/test_lm.py: mlx-lm's own ``mlx_lm.lora``, unchanged.

Usage: ``lm_reference.py FLAGS [--- FLAGS ...]``: one ``mlx_lm.lora`` run per
group of flags, one after the other in this process. Each run's reports go,
as JSON lines, to ``ADAPTER_PATH/losses.jsonl`` (the format ``python -m
mlx_fsdp.lora`` writes), through the reporting-callback factory that
``mlx_lm.lora.run`` calls; nothing else is changed.
"""

import os
import sys

import mlx.core as mx
import mlx_lm.lora as lora
from lm_common import split_runs

from mlx_fsdp.lm.train import _Reports


def main():
    rank = mx.distributed.init().rank()
    for flags in split_runs(sys.argv[1:]):
        def reports(report_to=None, project_name=None, log_dir=None, config=None):
            return _Reports(None, 0, os.path.join(log_dir, "losses.jsonl"), rank)

        lora.get_reporting_callbacks = reports
        sys.argv = ["mlx_lm.lora", *flags]
        lora.main()


if __name__ == "__main__":
    main()
