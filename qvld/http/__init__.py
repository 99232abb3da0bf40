"""The HTTP front: the API dialects people's clients speak (OpenAI chat and text
completions and Responses, Anthropic Messages, Ollama) and the web page, onto the same
handlers as the socket."""
