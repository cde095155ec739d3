// spindle: the command-line client of the Spindle coordinator (see cli.h for the exit codes).
#include <unistd.h>

#include <cstdlib>
#include <iostream>

#include "cli/cli.h"

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  std::map<std::string, std::string> env;
  for (const char* name :
       {"SPINDLE_COORDINATOR", "SPINDLE_TOKEN", "SPINDLE_TLS_CA", "SPINDLE_TRAIN_BINARY"}) {
    if (const char* v = std::getenv(name)) env[name] = v;
  }
  return spindle::RunCli(args, env, std::cout, std::cerr, isatty(STDOUT_FILENO) != 0);
}
