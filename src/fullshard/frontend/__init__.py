"""fullshard's training front end: the ``Accelerator``, its plugin, and Accelerate's free utilities.

What lives here: a module the ``Accelerator`` or its plugin reaches, or one that a public module imports
(``fullshard``, its top-level modules, ``fullshard.utils``, ``fullshard.accelerate``): Accelerate's free utilities,
those a script calls without an ``Accelerator``, live here beside the Accelerator's code, in the folder or flat
module of their topic (``save_fsdp_model`` in ``saving/`` with ``save_state``, ``prepare_data_loader`` in
``data/``). What only the ``fullshard`` command uses lives in ``cli/`` (``cli/memory_estimate.py``), not here.

Where a module goes: every module has one topic. A topic of three or more modules is a folder named for it; a
topic of one or two modules is flat here; no flat module shares a folder's topic. The folders:

- ``data/``: the Accelerator's loaders, their sample order and configuration, ``GradientState``, Accelerate's
  loader classes and free ``prepare_data_loader``;
- ``saving/``: ``save_state`` / ``load_state``, the resumed layout, model and optimizer state dicts, Accelerate's
  ``save_fsdp_model`` & co.;
- ``processes/``: this process's runtime, ``PartialState`` / ``AcceleratorState``, the ``on_*_process`` decorators,
  ``tqdm`` and ``get_logger``;
- ``handlers/``: the kwargs handlers; ``bigmodel/``: Accelerate's big-model utilities (one process, no sharding).

The flat topics: ``accelerator`` + ``one_process``; ``plugin`` + ``plugin_values``; ``prepare``; ``optim``;
``training`` + ``training_step``; ``invariant``; ``compile``; ``adapters`` (PEFT); ``parallelism``; ``project``;
``preemption``; ``enums``; ``ops``; ``memory``; ``trackers`` + ``tracker_selection``; ``env`` + ``launch_helpers``
(the launch environment); ``availability`` + ``versions`` (installed packages); ``refused`` (Accelerate's names
fullshard refuses). A new module joins its topic's folder, or a flat topic; the third module of a flat topic makes
it a folder. ``tests/unit/test_import_layers.py`` checks all of this (``FRONTEND_TOPICS``).

Accelerate's public module paths (``accelerate.utils``, ``accelerate.state``, ...) are mirrored one to one by the
re-export package ``fullshard.accelerate`` (which ``fullshard launch --as_accelerate`` serves as ``accelerate``), and
the names a script imports from fullshard directly by ``fullshard.utils`` and the top-level modules; so a name is
found where an Accelerate user looks for it while the code lives here, where its topic is. Nothing here imports
the CLI.
"""
