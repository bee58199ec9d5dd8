"""Model families. Use `adapters.registry.get_adapter(name)`; nothing registers on import."""
