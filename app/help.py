"""The `--help` formatter every ragcache subcommand uses (its own module, so command modules and
app/cli.py do not import each other)."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with each flag's default, except where there is none or the help text states it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)
