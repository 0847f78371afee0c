"""ragcache's Streamlit UI (``make ui`` = ``streamlit run ui/app.py``): chat, sources, TTFT, KV cache.

Built on the SDK only (``ragcache.pipeline``); nothing in ragcache imports this package.
"""
