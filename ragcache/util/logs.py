"""What ragcache's processes print: ragcache's own lines, and third-party notices only when asked.

Owns :func:`configure` (the quiet default, or verbose) and :func:`quiet_unless_configured` (what an
engine applies when it starts, unless the application chose already). vLLM, torch, transformers,
Triton and Hugging Face announce themselves on every start (vLLM's INFO lines and warnings such as
"CPU backend doesn't allow to use torch.set_num_threads", FutureWarnings, shard-loading bars, the
multiprocessing resource tracker's "leaked semaphore" warnings at shutdown). Quiet hides them in
this process *and in every process it starts from then on* (vLLM's engine core and workers, the
resource tracker), which read their settings from the environment: so the CLI, the server, the UI
and SDK users (``RAGPipeline.open``) see ragcache's lines, its progress and errors only. Verbose
(``ragcache -v``, or ``engine.verbose = true`` / ``RAGCACHE_ENGINE__VERBOSE=1`` for the SDK) hides
nothing. Warnings of the application's own code are never filtered; an environment variable the
user set is never overridden. Imports nothing from ragcache.
"""

from __future__ import annotations

import logging
import os
import warnings

#: environment read by the processes this one starts (and by vLLM/transformers when first imported)
QUIET_ENV = {
    "VLLM_LOGGING_LEVEL": "ERROR",  # vLLM's INFO lines and warnings, in every vLLM process
    "TORCH_CPP_LOG_LEVEL": "ERROR",  # c10 notices such as the NUMA binding line
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TOKENIZERS_PARALLELISM": "false",  # the tokenizers fork warning
    # Python warnings in child processes (they do not inherit this process's filters): deprecations,
    # and the resource tracker's leaked-semaphore report of vLLM's processes at shutdown
    "PYTHONWARNINGS": "ignore::FutureWarning,ignore::DeprecationWarning,"
                      "ignore::UserWarning:multiprocessing.resource_tracker",
    "RAGCACHE_QUIET_LOADING": "1",  # vLLM's "Loading weights" bar, the GGUF de-quantising bar
}

#: third-party loggers held at ERROR in a quiet process
QUIET_LOGGERS = ("vllm", "transformers", "torch", "triton", "faiss", "llama_index", "sentence_transformers",
                 "huggingface_hub", "httpx", "urllib3", "ray", "filelock")

#: modules whose Python warnings a quiet process ignores (a regex over the warning's module)
THIRD_PARTY = (r"(vllm|torch|transformers|triton|pydantic|llama_index|sentence_transformers|huggingface_hub|"
               r"faiss|numpy|ray|streamlit|multiprocessing|importlib|tqdm|safetensors)(\..*)?$")

_chosen: bool | None = None  # None: nobody chose yet; else the verbose flag that was applied


def configure(verbose: bool) -> None:
    """Quiet (``verbose=False``: third-party notices, warnings and loading bars hidden here and in
    every process started from now on) or verbose (nothing hidden). The application's choice: an
    engine started afterwards keeps it (see :func:`quiet_unless_configured`)."""
    global _chosen
    _chosen = verbose
    if verbose:
        for name in QUIET_LOGGERS:  # undo inherit(): a quiet parent's child asked for everything
            logging.getLogger(name).setLevel(logging.NOTSET)
        return
    for name, value in QUIET_ENV.items():
        os.environ.setdefault(name, value)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    for category in (FutureWarning, DeprecationWarning, UserWarning, RuntimeWarning):
        warnings.filterwarnings("ignore", category=category, module=THIRD_PARTY)


def inherit() -> None:
    """In a process a quiet one started (its environment says so, :data:`QUIET_ENV`): hold the
    third-party loggers at ERROR from the first import on. Run at ``import ragcache``, which vLLM's
    spawned engine core and workers import (as the parent's ``__main__``) before vLLM itself: vLLM
    0.32 configures its own logger only once the engine runs (``vllm.logger.configure_logging``),
    so a warning at import time (Triton's "doesn't include CPU backend") would otherwise reach
    Python's last-resort handler and print bare."""
    if os.environ.get("RAGCACHE_QUIET_LOADING") == "1":
        for name in QUIET_LOGGERS:
            logging.getLogger(name).setLevel(logging.ERROR)


def is_verbose() -> bool:
    """Whether third-party output is shown (verbose chosen); False until someone chose."""
    return bool(_chosen)


def quiet_unless_configured(verbose: bool) -> None:
    """Apply ``engine.verbose`` when an engine starts, unless the application already chose
    (:func:`configure`, e.g. the CLI's ``-v``): the SDK's default is as quiet as the CLI's."""
    if _chosen is None:
        configure(verbose)
