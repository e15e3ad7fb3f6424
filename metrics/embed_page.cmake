# cmake -DINPUT=page.html -DOUTPUT=page.cpp -DSYMBOL=kName -P embed_page.cmake
# Writes OUTPUT: the file INPUT as one C++ raw string, `extern const char SYMBOL[]` in ddp::metrics.
file(READ "${INPUT}" page)
set(delimiter "ddp_page_")
string(FIND "${page}" ")${delimiter}\"" clash)
if(NOT clash EQUAL -1)
  message(FATAL_ERROR "${INPUT} contains the raw string's end marker )${delimiter}\"")
endif()
file(WRITE "${OUTPUT}.tmp"
     "// Generated from ${INPUT} by metrics/embed_page.cmake: do not edit.\n"
     "namespace ddp::metrics {\n"
     "extern const char ${SYMBOL}[];\n"
     "const char ${SYMBOL}[] = R\"${delimiter}(${page})${delimiter}\";\n"
     "}  // namespace ddp::metrics\n")
configure_file("${OUTPUT}.tmp" "${OUTPUT}" COPYONLY)  # rewritten only when it changed
file(REMOVE "${OUTPUT}.tmp")
