"""What a model's output must look like: the tool-call formats of model families, and the token grammars that constrain decoding."""
