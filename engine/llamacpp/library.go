package llamacpp

import (
	"crypto/sha256"
	"debug/elf"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"

	"github.com/hybridgroup/yzma/pkg/llama"
)

// Release is the llama.cpp release this package is built and tested
// against: the CPU build that npm's @node-llama-cpp/linux-x64@3.21.1
// ships. The library exports no version function, so it is identified by
// the SONAME of each library and the sha256 of every file loaded.
const Release = "v0.4.0"

// InstallHint is the command that installs the pinned library.
const InstallHint = "make deps (it fetches @node-llama-cpp/linux-x64@3.21.1 with npm into .cache/llama.cpp)"

// pinned is the sha256 of every shared object of the release that the
// process may load: libllama and libggml by their versioned names, and
// the CPU backends ggml chooses among at run time.
var pinned = map[string]string{
	"libllama.v0.4.0.so":            "a1e1a2f1d1261070e33f25eca89700cfcf4b824f6a4113e9bc111c17aefcb52f",
	"libggml.v0.4.0.so":             "a8810737479e61c0131576a7a7b8d6ee09b1c161055065ba0579f671da7eb04c",
	"libggml-base.so":               "1eba024559799447e34687e12b6794e79ad3768a1b3d2cbca9fadc829f0f85c7",
	"libggml-cpu-alderlake.so":      "9855c4a776fe65b907eb3a2552f69d49bad692f9bd09709d0ee09773f3ed1cd9",
	"libggml-cpu-cannonlake.so":     "3e6b749e7f49d4a713a92156d25d7678163d46e8083ac63535c9499611fb2516",
	"libggml-cpu-cascadelake.so":    "a1ebbca4d2eef11b8e4b57e43b7a431bddb7e0a28a1c50b7183d053a69d60c81",
	"libggml-cpu-cooperlake.so":     "34f03e1df8c7076cff77e4512f8e6a6e2b613a779ef6560b58eaf65f8721e695",
	"libggml-cpu-haswell.so":        "e515aa4e0ea19c7bca544536db03b17ca6ad4ee24d8bf5dd9ea6f9c18bb9e135",
	"libggml-cpu-icelake.so":        "3e083fe7d5eaef3f2426b80aa50639484ce8b0ade2b9f8d16fc1321456761b91",
	"libggml-cpu-ivybridge.so":      "4d3f861530b860f39e7a4856d42ae9134def255ef201078f890ae75e1b27cbfe",
	"libggml-cpu-piledriver.so":     "d23438b7bcc20dd0fc25ad82feb2bd9bc354cbd225a1c1ec6009d8ec142faaaa",
	"libggml-cpu-sandybridge.so":    "486aa8a2c058387f0019e00931175d0b1b0a3b023cae3604427442506b3231ac",
	"libggml-cpu-sapphirerapids.so": "1a9d8718e725c19bd2e9a2c58286c2164572a00eff397cc3a746c76e7e2fe364",
	"libggml-cpu-skylakex.so":       "74d65c3926a1914588332d9bc7583f8a29666ff06ee34605604d2759b65f03f8",
	"libggml-cpu-sse42.so":          "dc2ad4e366258cb8e94ab5923c0febcba81136a1b6a91ae08d8382764459bb2e",
	"libggml-cpu-x64.so":            "bd2de057baaf343ec9fdabf2623de97f1f29aff7a8bd6e9b25f291f8af699bd0",
	"libggml-cpu-zen4.so":           "d101750f42c2ebc68ec4423645c7f167c6b84834743776f2074297a146924699",
}

// sonames are the names the binding opens and the SONAME each must carry.
var sonames = map[string]string{
	"libllama.so":     "libllama.v0.4.0.so",
	"libggml.so":      "libggml.v0.4.0.so",
	"libggml-base.so": "libggml-base.so",
}

// ErrLibrary is the error of a missing, unknown or altered library.
var ErrLibrary = errors.New("llamacpp: library")

var lib struct {
	once sync.Once
	dir  string
	err  error
}

// LoadLibrary checks and loads the llama.cpp libraries in dir, once per
// process: a library whose SONAME or checksum is not the pinned
// release's, or a shared object in dir that ggml could load and that is
// not pinned, is refused before anything is loaded. Later calls return
// the first call's result; a second directory is an error (the binding's
// functions are process-wide).
func LoadLibrary(dir string) error {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return fmt.Errorf("%w: %v", ErrLibrary, err)
	}
	lib.once.Do(func() {
		lib.dir = abs
		if lib.err = VerifyLibrary(abs); lib.err != nil {
			return
		}
		if err := llama.Load(abs); err != nil {
			lib.err = fmt.Errorf("%w: loading %s: %v", ErrLibrary, abs, err)
			return
		}
		llama.LogSet(llama.LogSilent())
		if err := llama.GGMLBackendLoadAllFromPath(abs); err != nil {
			lib.err = fmt.Errorf("%w: loading the CPU backends from %s: %v", ErrLibrary, abs, err)
			return
		}
		llama.BackendInit()
		if llama.GGMLBackendDeviceCount() == 0 {
			lib.err = fmt.Errorf("%w: no CPU backend in %s suits this processor", ErrLibrary, abs)
		}
	})
	if lib.err == nil && lib.dir != abs {
		return fmt.Errorf("%w: already loaded from %s, not %s", ErrLibrary, lib.dir, abs)
	}
	return lib.err
}

// VerifyLibrary checks dir without loading anything: the three libraries
// the binding opens carry the release's SONAMEs, and every shared object
// there has the pinned sha256.
func VerifyLibrary(dir string) error {
	if _, err := os.Stat(filepath.Join(dir, "libllama.so")); err != nil {
		return fmt.Errorf("%w: llama.cpp %s is not installed in %s (libllama.so missing): run %s", ErrLibrary, Release, dir, InstallHint)
	}
	names := make([]string, 0, len(sonames))
	for n := range sonames {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		got, err := soname(filepath.Join(dir, n))
		if err != nil {
			return fmt.Errorf("%w: %s: %v", ErrLibrary, n, err)
		}
		if want := sonames[n]; got != want {
			return fmt.Errorf("%w: %s has SONAME %q, not %q of llama.cpp %s: run %s", ErrLibrary, n, got, want, Release, InstallHint)
		}
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		return fmt.Errorf("%w: %v", ErrLibrary, err)
	}
	seen := 0
	for _, e := range entries {
		n := e.Name()
		if !strings.HasSuffix(n, ".so") || sonames[n] != "" && sonames[n] != n {
			continue // the unversioned links were checked through their SONAMEs
		}
		want, ok := pinned[n]
		if !ok {
			return fmt.Errorf("%w: %s in %s is no file of llama.cpp %s (ggml would load it): remove it, or run %s", ErrLibrary, n, dir, Release, InstallHint)
		}
		got, err := fileSHA256(filepath.Join(dir, n))
		if err != nil {
			return fmt.Errorf("%w: %v", ErrLibrary, err)
		}
		if got != want {
			return fmt.Errorf("%w: %s has sha256 %s, not the pinned %s: run %s", ErrLibrary, n, got, want, InstallHint)
		}
		seen++
	}
	for _, n := range []string{"libllama.v0.4.0.so", "libggml.v0.4.0.so", "libggml-base.so"} {
		if _, err := os.Stat(filepath.Join(dir, n)); err != nil {
			return fmt.Errorf("%w: %s missing in %s: run %s", ErrLibrary, n, dir, InstallHint)
		}
	}
	if seen < 4 {
		return fmt.Errorf("%w: no CPU backend (libggml-cpu-*.so) in %s: run %s", ErrLibrary, dir, InstallHint)
	}
	return nil
}

func soname(path string) (string, error) {
	f, err := elf.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	s, err := f.DynString(elf.DT_SONAME)
	if err != nil {
		return "", err
	}
	if len(s) != 1 {
		return "", fmt.Errorf("%d SONAME entries", len(s))
	}
	return s[0], nil
}

func fileSHA256(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", err
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

// DefaultLibraryDir is where make deps installs the library, relative to
// the repository: .cache/llama.cpp. KVSP_LLAMACPP_LIB overrides it.
func DefaultLibraryDir() string {
	if d := os.Getenv("KVSP_LLAMACPP_LIB"); d != "" {
		return d
	}
	return filepath.Join(".cache", "llama.cpp")
}
