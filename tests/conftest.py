import os
import sys

# Exactness tests compare float32 results; MLX's CUDA build runs float32
# matmuls in TF32 unless this is set before MLX is first used.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
