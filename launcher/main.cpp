// placeholder
int main() { return 2; }
