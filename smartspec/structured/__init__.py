"""Structured outputs: a request's JSON schema, regex, choice or grammar compiled (by llguidance) into a matcher
that masks every verified position and cuts drafts at the first token it forbids."""
