"""Every runtime workaround for a third-party package, each with the version it targets;
``patches/README.md`` indexes them."""
