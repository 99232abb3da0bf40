"""Each API dialect's routes: read the body, ask who is calling, hand the dialect's
translation module (``qvld.http.openai``, ``anthropic``, ``responses``, ``ollama``: no
I/O) the body and run what it asks for on the front's one generation path
(``routing.Front``). ``daemon`` holds the routes that are the daemon's own: health,
metrics, the web page."""
