"""A request turned into prompt rows: the one parser and checker of a generate request
(``request``), tool definitions (``tools``), images and video decoded to patches
(``image``, ``video``) and encoded (``vision``, ``image_cache``), conversations and their
exact token histories (``sessions``), and the prompt laid out with its mRoPE positions
(``prompt_builder``). Imports ``qvld.engine.model`` and ``qvld.engine.decoding``."""
