"""SGLang: the in-process engine and the HTTP server client."""
