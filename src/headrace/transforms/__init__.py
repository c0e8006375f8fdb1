"""One module per transformation: a recipe node plus its private iterator."""
