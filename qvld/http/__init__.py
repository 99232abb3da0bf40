"""The HTTP front: OpenAI-compatible chat completions onto the same handlers as the socket."""
