"""Injection corpus: payloads that try to get text of a Program (or of a transcript, or a plugin
name) executed as code. Every case asserts that nothing ran (a canary file stays unwritten) and how
the payload was handled: rejected at a named stage with a message fragment, or — a comment on an
honest program — canonicalised away."""
