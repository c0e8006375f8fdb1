"""One module per transformation: a recipe node plus its private iterator.

Internal to headrace: not part of its API (its names can change in any release).
"""

__all__: list[str] = []
