// dsv4_run: runs a dsv4 .pt2 package without Python.
//
//   dsv4_run [--ops-lib PATH] [--max-new-tokens N] [--metadata] PACKAGE.pt2 ID [ID ...]
//
// Loads the op library (--ops-lib, else $DSV4_OPS_LIBRARY) with RTLD_GLOBAL BEFORE the package: the package
// calls dsv4:: ops through the dispatcher, so their schemas must be registered first. Reads the package's
// dsv4 metadata (entries, cache shapes), allocates the caches, runs prefill on the prompt ids (smallest
// prefill bucket that holds them, right-padded, with lengths; a longer prompt in chunks through a prefill_chunk
// entry), then greedy decode (smallest decode bucket), and
// prints "generated: id id ..." on stdout. --metadata prints the decode entry's AOTI metadata.
// Every failure is one line on stderr and exit code 2; a completion cut short by the package's max_seq_len
// says so on stderr (as `python -m dsv4_export run` does) and exits 0.
#include <dlfcn.h>

#include <sys/stat.h>

#include <cerrno>
#include <cstdlib>
#include <iostream>
#include <algorithm>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#if __has_include(<torch/headeronly/version.h>)
#include <torch/headeronly/version.h>
#elif __has_include(<torch/version.h>)
#include <torch/version.h>
#endif

namespace {

[[noreturn]] void fail(const std::string& msg) {
  std::cerr << "dsv4_run: error: " << msg << std::endl;
  std::exit(2);
}

// A whole decimal integer (no trailing characters, in range), else fail() naming `what`.
int64_t parse_int(const std::string& s, const std::string& what) {
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  if (s.empty() || end != s.c_str() + s.size() || errno == ERANGE) fail(what + " must be an integer, got '" + s + "'");
  return v;
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, sep)) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

// The package's extra/dsv4_metadata.json is a flat JSON object of string values; the runner only needs a
// few keys whose values contain no quotes or escapes, so a string search is enough (no JSON library).
std::string json_string_value(const std::string& json, const std::string& key) {
  const std::string needle = "\"" + key + "\"";
  size_t k = json.find(needle);
  if (k == std::string::npos) fail("package metadata has no key " + key + " (not a dsv4 package?)");
  size_t colon = json.find(':', k + needle.size());
  size_t open = json.find('"', colon + 1);
  size_t close = json.find('"', open + 1);
  if (colon == std::string::npos || open == std::string::npos || close == std::string::npos) {
    fail("malformed package metadata at key " + key);
  }
  return json.substr(open + 1, close - open - 1);
}

std::string read_package_metadata(const std::string& pkg) {
  caffe2::serialize::PyTorchStreamReader reader(pkg);
  const std::string record = "extra/dsv4_metadata.json";
  if (!reader.hasRecord(record)) fail(pkg + " has no " + record + ": build it with `python -m dsv4_export build`");
  auto [data, size] = reader.getRecord(record);
  return std::string(static_cast<const char*>(data.get()), size);
}

c10::ScalarType parse_dtype(const std::string& s) {
  static const std::map<std::string, c10::ScalarType> table = {
      {"float32", at::kFloat},         {"float16", at::kHalf},    {"bfloat16", at::kBFloat16},
      {"float64", at::kDouble},        {"int64", at::kLong},      {"int32", at::kInt},
      {"int16", at::kShort},           {"int8", at::kChar},       {"uint8", at::kByte},
      {"bool", at::kBool},             {"float8_e4m3fn", at::kFloat8_e4m3fn},
      {"float8_e5m2", at::kFloat8_e5m2}};
  auto it = table.find(s);
  if (it == table.end()) fail("unsupported cache dtype " + s);
  return it->second;
}

struct Bucket {
  int64_t batch = -1;
  int64_t seq_len = 0;  // prefill only
  std::string name;
};

// Entry names: decode_b<B>, prefill_b<B>_s<S>, prefill_chunk_b<B>_s<C>. Picks the smallest entry holding 1 row
// of `tokens` tokens (batch -1 if none: `required` fails instead).
Bucket pick(const std::string& csv, const std::string& kind, int64_t tokens, bool required = true) {
  Bucket best;
  for (const auto& name : split(csv, ',')) {
    Bucket e;
    e.name = name;
    size_t b = name.find("_b"), s = name.find("_s", b == std::string::npos ? 0 : b);
    if (b == std::string::npos) fail("unexpected entry name " + name);
    e.batch = parse_int(name.substr(b + 2, s == std::string::npos ? std::string::npos : s - b - 2), "entry " + name);
    e.seq_len = s == std::string::npos ? 1 : parse_int(name.substr(s + 2), "entry " + name);
    if (e.seq_len < tokens) continue;
    if (best.batch < 0 || e.batch * e.seq_len < best.batch * best.seq_len) best = e;
  }
  if (best.batch < 0 && required) fail("package has no " + kind + " entry for " + std::to_string(tokens) + " tokens");
  return best;
}

}  // namespace

int run(int argc, char** argv) {
  std::string ops_lib = std::getenv("DSV4_OPS_LIBRARY") ? std::getenv("DSV4_OPS_LIBRARY") : "";
  int64_t max_new_tokens = 8;
  bool print_metadata = false;
  std::string pkg;
  std::vector<int64_t> prompt;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--ops-lib" || a == "--max-new-tokens") {
      if (i + 1 >= argc) fail(a + " needs a value (--help)");
      if (a == "--ops-lib") {
        ops_lib = argv[++i];
      } else {
        max_new_tokens = parse_int(argv[++i], "--max-new-tokens");
        if (max_new_tokens < 1) fail("--max-new-tokens must be >= 1, got " + std::to_string(max_new_tokens));
      }
    } else if (a == "--metadata") {
      print_metadata = true;
    } else if (a == "-h" || a == "--help") {
      std::cout << "usage: dsv4_run [--ops-lib PATH] [--max-new-tokens N] [--metadata] PACKAGE.pt2 ID [ID ...]\n";
      return 0;
    } else if (a.rfind("--", 0) == 0) {
      fail("unknown option " + a + " (--help)");
    } else if (pkg.empty()) {
      pkg = a;
    } else {
      prompt.push_back(parse_int(a, "prompt id"));
    }
  }
  if (pkg.empty() || (prompt.empty() && !print_metadata)) fail("need a package and at least one prompt id (--help)");
  struct stat st {};
  if (stat(pkg.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) fail("no package at " + pkg);
  if (ops_lib.empty()) fail("no op library: pass --ops-lib PATH/libdsv4_ops.so or set DSV4_OPS_LIBRARY");
  // RTLD_GLOBAL: the library's static initializers register torch.ops.dsv4.* in this process's dispatcher.
  if (!dlopen(ops_lib.c_str(), RTLD_NOW | RTLD_GLOBAL)) fail(std::string("cannot load op library: ") + dlerror());

  const std::string meta_json = read_package_metadata(pkg);
  const std::string built_torch = json_string_value(meta_json, "dsv4.torch_version");
#ifdef TORCH_VERSION_MAJOR
  {
    const std::string here = std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + ".";
    if (built_torch.rfind(here, 0) != 0) {
      fail("package built with torch " + built_torch + ", this runner links torch " + here +
           "x: rebuild the package (or the runner) with the same torch");
    }
  }
#endif
  const at::Device device(json_string_value(meta_json, "dsv4.device"));
  if (device.is_cuda()) {
    // The CUDA runtime pieces (AOTI's CUDA model runner, CUDA hooks) register from libtorch_cuda's static
    // initializers: make sure it is loaded even if the linker dropped it as unneeded.
    dlopen("libtorch_cuda.so", RTLD_NOW | RTLD_GLOBAL);
  }
  const int64_t vocab = parse_int(json_string_value(meta_json, "dsv4.vocab_size"), "dsv4.vocab_size");
  for (int64_t id : prompt) {
    if (id < 0 || id >= vocab) {
      fail("prompt id " + std::to_string(id) + " outside [0, vocab_size=" + std::to_string(vocab) + ")");
    }
  }
  const int64_t t = static_cast<int64_t>(prompt.size());
  const int64_t max_seq = parse_int(json_string_value(meta_json, "dsv4.max_seq_len"), "dsv4.max_seq_len");
  if (!print_metadata && t > max_seq) {
    fail("prompt of " + std::to_string(t) + " ids exceeds the package's max_seq_len " + std::to_string(max_seq));
  }
  const Bucket decode = pick(json_string_value(meta_json, "dsv4.cpp.decode_entries"), "decode", 1);
  torch::inductor::AOTIModelPackageLoader decode_model(pkg, decode.name);
  if (print_metadata) {
    for (const auto& [k, v] : decode_model.get_metadata()) std::cout << k << "=" << v << "\n";
    return 0;
  }
  // The smallest prefill bucket holding the prompt, else chunks through the prefill_chunk entry (the longest).
  const std::string chunk_key = "dsv4.cpp.prefill_chunk_entries";  // absent in packages built before it
  const std::string chunk_csv =
      meta_json.find("\"" + chunk_key + "\"") == std::string::npos ? "" : json_string_value(meta_json, chunk_key);
  Bucket prefill = pick(json_string_value(meta_json, "dsv4.cpp.prefill_entries"), "prefill", t, chunk_csv.empty());
  const bool chunked = prefill.batch < 0;
  if (chunked) {
    for (const auto& name : split(chunk_csv, ',')) {
      Bucket e = pick(name, "prefill_chunk", 1);
      if (prefill.batch < 0 || e.seq_len > prefill.seq_len) prefill = e;
    }
  }
  torch::inductor::AOTIModelPackageLoader prefill_model(pkg, prefill.name);
  // Every token after the first is one decode step at the next position: at most max_seq - t + 1 tokens.
  const int64_t n_new = std::min(max_new_tokens, max_seq - t + 1);

  std::vector<at::Tensor> caches;
  for (const auto& spec : split(json_string_value(meta_json, "dsv4.cpp.caches"), ';')) {
    auto parts = split(spec, ':');  // name:dtype:d0xd1x...
    if (parts.size() != 3) fail("malformed cache spec " + spec);
    std::vector<int64_t> shape;
    for (const auto& d : split(parts[2], 'x')) shape.push_back(parse_int(d, "cache spec " + spec));
    caches.push_back(at::zeros(shape, at::TensorOptions().dtype(parse_dtype(parts[1])).device(device)));
  }
  auto with_caches = [&](std::vector<at::Tensor> inputs) {
    inputs.insert(inputs.end(), caches.begin(), caches.end());
    return inputs;
  };
  auto opts = at::TensorOptions().dtype(at::kLong).device(device);

  // Prefill the prompt into cache row 0, right-padded to the bucket length; rows 1.. of a larger bucket
  // get one token 0 and are never read. Chunked: C positions at a time from start c0 (row 0's last chunk
  // padded; rows 1.. have no tokens), the logits of the chunk holding the last token.
  const at::Tensor ids = at::tensor(prompt, at::kLong);
  at::Tensor logits;
  for (int64_t c0 = 0; c0 < t; c0 += prefill.seq_len) {
    const int64_t n = std::min(prefill.seq_len, t - c0);
    at::Tensor tokens = at::zeros({prefill.batch, prefill.seq_len}, opts);
    tokens[0].narrow(0, 0, n).copy_(ids.narrow(0, c0, n));
    at::Tensor lengths = chunked ? at::zeros({prefill.batch}, opts) : at::ones({prefill.batch}, opts);
    lengths[0].fill_(n);
    logits = chunked ? prefill_model.run(with_caches({tokens, lengths, at::full({prefill.batch}, c0, opts)}))[0]
                     : prefill_model.run(with_caches({tokens, lengths}))[0];
  }

  std::vector<int64_t> generated;
  int64_t pos = t;
  for (int64_t i = 0; i < n_new; ++i) {
    const int64_t next = logits[0].argmax().item<int64_t>();
    generated.push_back(next);
    if (i + 1 == n_new) break;
    at::Tensor tok = at::zeros({decode.batch}, opts);
    at::Tensor positions = at::zeros({decode.batch}, opts);
    tok[0].fill_(next);
    positions[0].fill_(pos++);
    logits = decode_model.run(with_caches({tok, positions}))[0];
  }
  std::cout << "generated:";
  for (int64_t id : generated) std::cout << " " << id;
  std::cout << std::endl;
  if (n_new < max_new_tokens) {
    std::cerr << "dsv4_run: cut short after " << n_new << " of " << max_new_tokens
              << " tokens: the package's caches hold max_seq_len=" << max_seq << " positions" << std::endl;
  }
  return 0;
}

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const c10::Error& e) {
    fail(e.what_without_backtrace());  // torch's own messages carry a C++ stack trace
  } catch (const std::exception& e) {
    fail(e.what());
  }
}
