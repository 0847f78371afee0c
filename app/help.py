"""The `--help` formatter and the argument parser every ragcache subcommand uses (their own module,
so command modules and app/cli.py do not import each other)."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with each flag's default, except where there is none, where the flag is a switch
    (``--no-calibrate``'s default True would read as "skips by default") or the help text states it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        switch = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
        if switch or action.default in (None, False) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line naming the problem and where the help is,
    with exit status 2 (argparse itself prints the whole usage first)."""

    def error(self, message: str):  # noqa: D401 - argparse's hook
        self.exit(2, f"ragcache: error: {self.prog}: {message}; see `{self.prog} --help`\n")
