"""The processes of a run: the one a script runs in, Accelerate's process-wide state, who does what, who prints.

- ``runtime.py``: this process's rank, world, device and process group (initialised or adopted).
- ``shared_state.py``: Accelerate's ``PartialState`` and ``AcceleratorState`` over the runtime.
- ``work_split.py``: the ``on_*_process`` decorators and ``split_between_processes``.
- ``process_output.py``: Accelerate's ``tqdm`` and ``get_logger``, shown by some processes only.
"""
