"""The one exception type of the ``launch`` package.

Usage::

    from launch.errors import LaunchError

    try:
        placement = detect()
    except LaunchError as err:   # a launcher variable, option or template that breaks a rule
        sys.exit(f"launch: {err}")
"""

from __future__ import annotations

__all__ = ["LaunchError"]


class LaunchError(ValueError):
    """Bad input to ``launch``: the message names the input, the rule and the value."""
