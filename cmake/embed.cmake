# Writes the file IN as a C++ raw string constant named VAR into OUT.
file(READ ${IN} content)
file(WRITE ${OUT} "static const char ${VAR}[] = R\"opfuse_embed(${content})opfuse_embed\";\n")
