"""Worker processes and threads that run user functions off the main thread.

Internal to headrace: not part of its API (its names can change in any release).
"""

__all__: list[str] = []
