"""What the command line prints besides its own results: ragcache's log lines and progress bars only.

Owns :func:`configure_output`. vLLM, torch, transformers, faiss and pydantic announce themselves
on every start (Triton and NUMA notices, shard-loading bars, deprecation warnings); a user of the
CLI sees ragcache's own lines, progress bars and results, and the rest only with ``-v``.
"""

from __future__ import annotations

import logging
import os
import warnings

#: loggers whose INFO lines users see without -v
OWN_LOGGERS = ("ragcache", "app")


def configure_output(verbose: bool) -> None:
    """Logging, warnings and third-party verbosity for one CLI run.

    Without ``verbose``: ragcache's loggers at INFO, everything else at WARNING (vLLM at ERROR),
    third-party warnings (deprecations, pydantic schema notices) and C++ notices (torch's NUMA
    binding line) hidden, vLLM's and transformers' loading bars off. With ``verbose``: DEBUG
    everywhere and nothing hidden. vLLM always logs to stderr, so stdout holds only results
    (``ask --json`` prints exactly one JSON object).
    """
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if verbose:
        return
    for name in OWN_LOGGERS:
        logging.getLogger(name).setLevel(logging.INFO)
    logging.getLogger("vllm").setLevel(logging.ERROR)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # c10 notices such as the NUMA binding line
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    # read by BlendEngine (no shard-loading bar) and models.convert_gguf (no de-quantising bar); transformers
    # itself is not imported here: refusing bad input must not pay for it
    os.environ.setdefault("RAGCACHE_QUIET_LOADING", "1")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", message=r".*attribute with value .* was provided to the `Field\(\)` function")
