"""What the command line prints besides its own results: ragcache's log lines and progress only.

Owns :func:`configure_output`. Third-party notices (vLLM, torch, transformers, Triton, Hugging
Face: INFO lines, warnings, loading bars) are hidden in this process and in every process it starts
(the engine's) by :func:`ragcache.util.logs.configure`, and shown with ``-v``.
"""

from __future__ import annotations

import logging
import os
import warnings

from ragcache.util import logs

#: loggers whose INFO lines users see without -v
OWN_LOGGERS = ("ragcache", "app")


def configure_output(verbose: bool) -> None:
    """Logging, warnings and third-party verbosity for one CLI run.

    Without ``verbose``: ragcache's loggers at INFO, everything else at WARNING, third-party
    notices, warnings and loading bars hidden here and in the engine's processes
    (:func:`ragcache.util.logs.configure`). With ``verbose``: DEBUG everywhere and nothing hidden. vLLM
    always logs to stderr, so stdout holds only results (``ask --json`` prints exactly one JSON object).
    """
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logs.configure(verbose)
    if not verbose:
        for name in OWN_LOGGERS:
            logging.getLogger(name).setLevel(logging.INFO)
        # the CLI's process runs no user code: its deprecation notices are all third-party
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
