"""Saving and loading training state, Accelerate's way.

- ``state_io.py``: ``Accelerator.save_state`` / ``load_state``, what goes into a training folder.
- ``resume_layout.py``: how many processes saved a checkpoint, and the one warning when another number loads it.
- ``accelerator_checkpoints.py``: the Accelerator's checkpoint methods (``save_state``, ``load_state``, ...),
  mixed into it.
- ``model_state.py``: a sharded model's and its optimizer's state dicts, through the engine's API.
- ``fsdp_checkpoints.py``: Accelerate's free per-object functions (``save_fsdp_model``, ``load_fsdp_optimizer``, ...).

How each file is written and checked is ``fullshard.checkpoint``'s.
"""
