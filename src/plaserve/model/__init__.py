"""Model definition, weight loading and tokenization."""
