"""ragcache's Streamlit app (``make ui``, i.e. ``streamlit run ui/app.py``).

Pages: Chat (streamed answers with sources and metrics, TTFT over the session, KV cache per tier)
and Ingest (upload files into a new or an existing index). The sidebar picks the index; the chat
page adds the query settings. One BlendEngine serves every session of the server process (see
ui/state.py). Settings come from ./settings.toml and RAGCACHE_* variables, as for the CLI.
"""

from __future__ import annotations

import sys
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:  # `streamlit run ui/app.py` puts ui/ on sys.path, not the repo root
    sys.path.insert(0, str(_REPO))

import streamlit as st  # noqa: E402

from ragcache.config import ConfigError, Settings  # noqa: E402
from ui import state  # noqa: E402

INDEX_KEY = "index"


def index_sidebar(settings: Settings) -> str | None:
    """The index selector (on every page); None when there is no index yet."""
    try:
        names = state.list_indexes(settings)
    except Exception as exc:  # the server of ui.server_url is down or refuses
        st.sidebar.error(state.describe_error(exc), icon=":material/error:")
        return None
    if state.PENDING_INDEX in st.session_state:
        pending = st.session_state.pop(state.PENDING_INDEX)
        if pending in names:
            st.session_state[INDEX_KEY] = pending
    with st.sidebar:
        st.subheader("Index")
        if not names:
            st.caption(f"No index under `{state.index_dir(settings)}` yet.")
            return None
        if st.session_state.get(INDEX_KEY) not in names:
            st.session_state[INDEX_KEY] = names[0]
        return st.selectbox("Index", names, key=INDEX_KEY, label_visibility="collapsed",
                            help=f"indexes under {state.index_dir(settings)}")


def main() -> None:
    st.set_page_config(page_title="ragcache", page_icon=":material/bolt:", layout="wide")
    try:
        settings = state.load_settings()
    except ConfigError as exc:
        st.error(state.describe_error(exc), icon=":material/error:")
        st.stop()
    page = st.navigation([
        st.Page("chat_page.py", title="Chat", icon=":material/chat:", url_path="chat", default=True),
        st.Page("ingest_page.py", title="Ingest", icon=":material/upload_file:", url_path="ingest"),
    ])
    st.session_state[state.ACTIVE_INDEX] = index_sidebar(settings)
    page.run()


main()
