"""Accelerate's big-model utilities: sizes and device maps, tied weights, moving and loading tensors, offload.

These act on one process's model (no sharding, no collectives). With fullshard they serve what comes before or
after training: loading a checkpoint that ``merge-weights`` or ``save_model`` wrote into an unsharded model,
planning where the layers of an inference model go, offloading weights to disk.

- ``sizes.py``: ``get_max_layer_size``, ``get_max_memory``, ``get_balanced_memory``, ``infer_auto_device_map``.
- ``tied.py``: ``find_tied_parameters``, ``check_tied_parameters_on_same_device``, ``retie_parameters``.
- ``tensors.py``: ``set_module_tensor_to_device``, ``named_module_tensors``.
- ``hooks.py``: ``remove_hook_from_module``, ``remove_hook_from_submodules`` (PEFT calls them; nothing here adds hooks).
- ``loading.py``: ``load_state_dict``, ``load_checkpoint_in_model``, ``shard_checkpoint``.
- ``cpu_hook.py``: ``cpu_offload_with_hook`` (a model moved to its device when it runs).
- ``offload.py``: ``offload_state_dict``, ``load_offloaded_weights`` (Accelerate's folder format).
"""
