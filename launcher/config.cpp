// placeholder: replaced by the command line's issue
