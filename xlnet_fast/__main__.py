"""``python -m xlnet_fast`` (= ``xlnet-fast``)."""

import os
import sys


def _shadowing_directory() -> str | None:
    """The directory imported as the package ``xlnet_fast`` instead of this one, when Python found a
    folder named ``xlnet_fast`` without an ``__init__.py`` first (a clone's root, in the directory it
    started in): the package is then an empty namespace package, and an editable install's finder
    supplies only its submodules (this one). None when ``xlnet_fast`` is the package itself."""
    package = sys.modules.get(__package__ or "xlnet_fast")
    if package is None or getattr(package, "__file__", None) is not None:
        return None
    locations = list(getattr(package, "__path__", None) or [])
    return os.path.abspath(locations[0]) if locations else "a namespace package"


_shadow = _shadowing_directory()
if _shadow is not None:
    print(f"xlnet-fast: error: Python imported {_shadow} as the package xlnet_fast (an empty namespace package: a "
          f"clone of this repository named xlnet_fast in the directory Python started in, {os.getcwd()}?): start "
          "Python in another directory, run the xlnet-fast command, or rename the clone (e.g. xlnet-fast)",
          file=sys.stderr)
    sys.exit(1)

from .cli import main  # noqa: E402  (after the check: cli imports the package's own names)

sys.exit(main())
