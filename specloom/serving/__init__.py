"""Serving pieces (issue 6, in progress): streaming text that stays exact when a speculative step emits several
tokens at once -- the incremental detokenizer and chunk-invariant tool-call / reasoning parsers."""
