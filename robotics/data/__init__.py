"""Demo datasets: robomimic-layout HDF5 reading and action-chunk samples."""

from robotics.data.chunk_dataset import ChunkDataset
from robotics.data.robomimic_io import Demo, demo_names, load_demos, read_env_args

__all__ = ["ChunkDataset", "Demo", "demo_names", "load_demos", "read_env_args"]
