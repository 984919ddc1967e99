"""What a member is at run time: the base model and its adapter (GGUF files included), one
member and its train loop, many members on one shared base, activation memory, and the
checkpoint format."""
