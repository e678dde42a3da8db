"""What a model's output must look like: the tool-call formats of model families, the token grammars that
constrain decoding, and the checks of a reply's form against what a person asked (shared by the judge's
practice and the gateway's best of k)."""
