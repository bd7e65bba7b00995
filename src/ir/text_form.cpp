// The canonical text form of a graph:
//
//   graph {
//     %0 = input() {name="x"} : f32[s0, 4096]
//     %1 = scalar() {value=0.5, weak=true} : f32[]
//     %2 = mul(%0, %1) : f32[s0, 4096]
//     %3 = sum(%2) {dims=[1], keepdim=true} : f32[s0, 1]
//     return (%2, %3)
//   }
//
// Attribute values: integers `3`, floats `0.5` (always with '.', 'e', inf or
// nan), `true`/`false`, strings `"..."`, integer lists `[1, 2]`, shapes
// `<s0, 4>`, dtypes `f32`.
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "ir/graph.h"
#include "ir/ops.h"

namespace opfuse {
namespace {

std::string format_double(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  std::string s = buf;
  if (s.find_first_of(".e") == std::string::npos) s += ".0";
  return s;
}

std::string quote(const std::string& s) {
  std::string r = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') r += '\\';
    r += c;
  }
  return r + "\"";
}

std::string format_attr(const AttrValue& v) {
  struct V {
    std::string operator()(int64_t x) const { return std::to_string(x); }
    std::string operator()(double x) const { return format_double(x); }
    std::string operator()(bool x) const { return x ? "true" : "false"; }
    std::string operator()(const std::string& x) const { return quote(x); }
    std::string operator()(const std::vector<int64_t>& x) const {
      std::string s = "[";
      for (size_t i = 0; i < x.size(); ++i) s += (i ? ", " : "") + std::to_string(x[i]);
      return s + "]";
    }
    std::string operator()(const Shape& x) const {
      std::string s = "<";
      for (size_t i = 0; i < x.size(); ++i) s += (i ? ", " : "") + to_string(x[i]);
      return s + ">";
    }
    std::string operator()(DType x) const { return dtype_name(x); }
  };
  return std::visit(V{}, v);
}

class Parser {
 public:
  explicit Parser(const std::string& t) : s_(t) {}

  Graph parse() {
    Graph g;
    expect_word("graph");
    expect("{");
    while (true) {
      ws();
      if (peek_word("return")) break;
      parse_node(g);
    }
    expect_word("return");
    expect("(");
    ws();
    if (!try_eat(")")) {
      do g.outputs.push_back(node_ref(g)); while (try_eat(","));
      expect(")");
    }
    expect("}");
    ws();
    if (i_ != s_.size()) fail("unexpected text after the graph");
    return g;
  }

 private:
  const std::string& s_;
  size_t i_ = 0;

  [[noreturn]] void fail(const std::string& msg) const {
    int line = 1;
    for (size_t k = 0; k < i_ && k < s_.size(); ++k) line += s_[k] == '\n';
    throw GraphError("line " + std::to_string(line) + ": " + msg);
  }
  void ws() {
    while (i_ < s_.size()) {
      if (std::isspace(static_cast<unsigned char>(s_[i_]))) ++i_;
      else if (s_[i_] == '#') { while (i_ < s_.size() && s_[i_] != '\n') ++i_; }
      else break;
    }
  }
  bool try_eat(const char* t) {
    ws();
    size_t n = std::char_traits<char>::length(t);
    if (s_.compare(i_, n, t) == 0) { i_ += n; return true; }
    return false;
  }
  void expect(const char* t) {
    if (!try_eat(t)) fail(std::string("expected '") + t + "'");
  }
  std::string word() {
    ws();
    size_t j = i_;
    while (j < s_.size() && (std::isalnum(static_cast<unsigned char>(s_[j])) || s_[j] == '_')) ++j;
    if (j == i_) fail("expected a name");
    std::string w = s_.substr(i_, j - i_);
    i_ = j;
    return w;
  }
  bool peek_word(const char* w) {
    ws();
    size_t n = std::char_traits<char>::length(w);
    return s_.compare(i_, n, w) == 0;
  }
  void expect_word(const char* w) {
    if (word() != w) fail(std::string("expected '") + w + "'");
  }
  // "%N": the number N.
  int node_number() {
    expect("%");
    ws();
    size_t j = i_;
    while (j < s_.size() && std::isdigit(static_cast<unsigned char>(s_[j]))) ++j;
    if (j == i_) fail("expected a node number after '%'");
    if (j - i_ > 9) fail("node number " + s_.substr(i_, j - i_) + " is too large");
    int id = std::stoi(s_.substr(i_, j - i_));
    i_ = j;
    return id;
  }
  int node_ref(const Graph& g) {
    int id = node_number();
    if (id < 0 || id >= static_cast<int>(g.nodes.size())) fail("%" + std::to_string(id) + " is used before it is defined");
    return id;
  }
  // Text up to the matching closer, for expressions inside shapes.
  std::string until_any(const char* stops) {
    int depth = 0;
    size_t j = i_;
    while (j < s_.size()) {
      char c = s_[j];
      if (c == '(') ++depth;
      else if (c == ')') { if (depth == 0) break; --depth; }
      else if (depth == 0 && std::strchr(stops, c)) break;
      ++j;
    }
    std::string r = s_.substr(i_, j - i_);
    i_ = j;
    return r;
  }
  Shape dims(char close) {
    Shape out;
    ws();
    if (i_ < s_.size() && s_[i_] == close) { ++i_; return out; }
    while (true) {
      char stops[3] = {',', close, 0};
      std::string text = until_any(stops);
      std::string err;
      Expr e = parse_expr(text, &err);
      if (!e) fail("bad size expression '" + text + "': " + err);
      out.push_back(e);
      if (try_eat(",")) continue;
      if (i_ < s_.size() && s_[i_] == close) { ++i_; break; }
      fail(std::string("expected ',' or '") + close + "'");
    }
    return out;
  }
  AttrValue attr_value() {
    ws();
    if (i_ >= s_.size()) fail("expected an attribute value");
    char c = s_[i_];
    if (c == '"') {
      ++i_;
      std::string r;
      while (i_ < s_.size() && s_[i_] != '"') {
        if (s_[i_] == '\\' && i_ + 1 < s_.size()) ++i_;
        r += s_[i_++];
      }
      if (i_ >= s_.size()) fail("unterminated string");
      ++i_;
      return r;
    }
    if (c == '[') {
      ++i_;
      std::vector<int64_t> v;
      if (try_eat("]")) return v;
      do {
        AttrValue x = attr_value();
        if (!std::holds_alternative<int64_t>(x)) fail("an integer list holds integers only");
        v.push_back(std::get<int64_t>(x));
      } while (try_eat(","));
      expect("]");
      return v;
    }
    if (c == '<') {
      ++i_;
      return dims('>');
    }
    if (c == '-' || c == '+' || c == '.' || std::isdigit(static_cast<unsigned char>(c))) {
      size_t j = i_;
      if (s_[j] == '-' || s_[j] == '+') ++j;
      if (s_.compare(j, 3, "inf") == 0) {
        double v = s_[i_] == '-' ? -INFINITY : INFINITY;
        i_ = j + 3;
        return v;
      }
      bool is_float = false;
      while (j < s_.size() && (std::isalnum(static_cast<unsigned char>(s_[j])) || s_[j] == '.' ||
                               ((s_[j] == '-' || s_[j] == '+') && (s_[j - 1] == 'e' || s_[j - 1] == 'E')))) {
        if (s_[j] == '.' || s_[j] == 'e' || s_[j] == 'E') is_float = true;
        ++j;
      }
      std::string num = s_.substr(i_, j - i_);
      i_ = j;
      try {
        if (is_float) {
          // strtod, not stod: stod rejects subnormals (ERANGE) that print_graph writes.
          char* end = nullptr;
          double v = std::strtod(num.c_str(), &end);
          if (end != num.c_str() + num.size()) fail("bad number '" + num + "'");
          return v;
        }
        return static_cast<int64_t>(std::stoll(num));
      } catch (...) {
        fail("bad number '" + num + "'");
      }
    }
    std::string w = word();
    if (w == "true") return true;
    if (w == "false") return false;
    if (w == "inf") return INFINITY;
    if (w == "nan") return NAN;
    DType t;
    if (parse_dtype(w, &t)) return t;
    fail("bad attribute value '" + w + "'");
  }
  void parse_node(Graph& g) {
    int id = node_ref_def(g);
    expect("=");
    std::string op = word();
    expect("(");
    std::vector<int> inputs;
    ws();
    if (!try_eat(")")) {
      do inputs.push_back(node_ref(g)); while (try_eat(","));
      expect(")");
    }
    Attrs attrs;
    if (try_eat("{")) {
      ws();
      if (!try_eat("}")) {
        do {
          std::string k = word();
          expect("=");
          attrs[k] = attr_value();
        } while (try_eat(","));
        expect("}");
      }
    }
    expect(":");
    DType t;
    std::string tn = word();
    if (!parse_dtype(tn, &t)) fail("unknown dtype '" + tn + "'");
    expect("[");
    Shape shape = dims(']');
    if (!find_op(op)) fail("unknown op '" + op + "'");
    g.add_typed(op, inputs, attrs, t, shape);
    (void)id;
  }
  int node_ref_def(const Graph& g) {
    int id = node_number();
    if (id != static_cast<int>(g.nodes.size()))
      fail("nodes must be numbered in order: expected %" + std::to_string(g.nodes.size()) + ", found %" + std::to_string(id));
    return id;
  }
};

}  // namespace

std::string print_graph(const Graph& g) {
  std::ostringstream os;
  os << "graph {\n";
  for (const Node& n : g.nodes) {
    os << "  %" << n.id << " = " << n.op << "(";
    for (size_t i = 0; i < n.inputs.size(); ++i) os << (i ? ", " : "") << "%" << n.inputs[i];
    os << ")";
    if (!n.attrs.empty()) {
      os << " {";
      bool first = true;
      for (auto& [k, v] : n.attrs) {
        os << (first ? "" : ", ") << k << "=" << format_attr(v);
        first = false;
      }
      os << "}";
    }
    os << " : " << dtype_name(n.dtype) << shape_to_string(n.shape) << "\n";
  }
  os << "  return (";
  for (size_t i = 0; i < g.outputs.size(); ++i) os << (i ? ", " : "") << "%" << g.outputs[i];
  os << ")\n}\n";
  return os.str();
}

Graph parse_graph(const std::string& text) { return Parser(text).parse(); }

}  // namespace opfuse
