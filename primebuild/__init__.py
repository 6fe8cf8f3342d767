"""primebuild: declarative, reproducible async RL for LLMs."""

import os as _os

__version__ = "0.1.0"

# An install maps the checkout's top-level folders (builders/, runtime/, kernels/) into this namespace
# (setup.py). A process that only has the checkout on PYTHONPATH -- code of ours running inside the
# separate vLLM environment, where primebuild is not installed -- gets the same mapping from this:
# submodules are then also looked up in the checkout's root.
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_checkout, "setup.py")) and _os.path.isdir(_os.path.join(_checkout, "runtime")):
    __path__.append(_checkout)  # noqa: F821 (a package's __path__ is defined at import)
