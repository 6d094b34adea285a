"""Graph passes run by compile(): fusion (passes/fusion.py). They read the user's Graph and
return what the executable lowers instead; they never change the Graph."""
