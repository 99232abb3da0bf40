"""The step loop and its policy: a generation as data (``sequence``), the paged KV
cache's bookkeeping (``blocks``), who runs and on which blocks (``scheduler``, no
threads, no model), and the loop that owns all of it (``step_loop``). Imports the
rooms below it, never the engine's front."""
