"""What members train on: the user's rows and the built-in and reasoning-gym tasks, the fields
a row must have and the prompt it becomes, the order rows are read in, and the rewards and
rubrics that score completions."""
