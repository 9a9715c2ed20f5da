"""Graph passes: each takes a graph (or its index) and returns another: lean operator
variants, updates moved into the backward pass, random-op replay, the rewriter."""
