"""The ragcache application: command line (`ragcache ...`) built on the SDK."""
