"""Every runtime workaround for a third-party package, each with the version it targets;
this folder's ``README.md`` indexes them."""
