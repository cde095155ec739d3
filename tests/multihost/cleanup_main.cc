// multihost_cleanup: deletes the network namespaces of multi-host test runs whose process is gone
// (a test killed at its timeout cannot delete its own); run by ctest after the multihost tests.
#include "tests/multihost/test_network.h"

int main() {
  spindle::testing::RemoveStaleNamespaces();
  return 0;
}
