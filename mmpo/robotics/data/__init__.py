"""Demo datasets: robomimic-layout HDF5 reading and action-chunk samples."""

from mmpo.robotics.data.chunk_dataset import ChunkDataset
from mmpo.robotics.data.robomimic_io import Demo, demo_names, load_demos, read_env_args

__all__ = ["ChunkDataset", "Demo", "demo_names", "load_demos", "read_env_args"]
