"""fullshard's training front end: the ``Accelerator`` and what it calls.

The rule of this package: a module here is the Accelerator's (or its plugin's) and is named for its topic
(``data``, ``state_io``, ``training``, ``compile``, ...); a folder only for three modules or more on one topic
(``bigmodel/``, ``handlers/``, ``tracking/``), never beside a flat module of the same topic. Accelerate's public
module paths (``accelerate.utils``, ``accelerate.state``, ...) are mirrored one to one by the re-export package
``fullshard.accelerate`` (which ``fullshard launch --as_accelerate`` serves as ``accelerate``), and the names a
script imports from fullshard directly by ``fullshard.utils`` and the top-level modules; so a name is found where
an Accelerate user looks for it while the code lives here, where its topic is. Nothing here imports the CLI.
"""
