"""The main job: tasks, the trainer loop, checkpoints, metrics."""
