// Command argocd-health-test runs Argo CD resource health checks the way Argo CD does, outside Argo CD.
//
// For every <group>/<Kind>/health_test.yaml under the directories given, it loads health.lua in
// gopher-lua with the libraries Argo CD opens for a script from argocd-cm (util/lua/lua.go runLua:
// SkipOpenLibs, then package, base, table and a safe os with only time and date), sets the global
// `obj` from each testdata object, runs the script under a 1 s context and compares the returned
// status and message with the test case, as Argo CD's util/lua health_test.go does. It also refuses a
// script that names a library argocd-cm does not open, since such a call fails only on the path that
// reaches it.
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"time"

	lua "github.com/yuin/gopher-lua"
	luajson "layeh.com/gopher-json"
	"sigs.k8s.io/yaml"
)

// Argo CD runs each health script under a context with this timeout (util/lua/lua.go runLua).
const scriptTimeout = time.Second

var healthStatuses = map[string]bool{
	"Healthy": true, "Progressing": true, "Degraded": true, "Suspended": true, "Missing": true, "Unknown": true,
}

// Libraries gopher-lua has that a script from argocd-cm does not get, and string methods (s:sub(...)),
// which need the string library as the strings' metatable.
var closedLibrary = regexp.MustCompile(
	`\b(string|math|io|debug|coroutine|channel)\s*\.|:\s*(byte|char|find|format|gmatch|gsub|len|lower|match|rep|reverse|sub|upper)\s*\(`)

// A comment, to the end of its line (a "--" inside a string literal is cut too, which can only hide a use).
var luaComment = regexp.MustCompile(`--.*`)

type healthStatus struct {
	Status  string `json:"status"`
	Message string `json:"message"`
}

type testCase struct {
	HealthStatus healthStatus `json:"healthStatus"`
	InputPath    string       `json:"inputPath"`
}

type testFile struct {
	Tests []testCase `json:"tests"`
}

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: argocd-health-test DIR... (directories holding <group>/<Kind>/health_test.yaml)")
		os.Exit(2)
	}
	failures, cases := 0, 0
	for _, root := range os.Args[1:] {
		files, err := findTests(root)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		for _, file := range files {
			f, c := runFile(file)
			failures += f
			cases += c
		}
	}
	if cases == 0 {
		fmt.Fprintln(os.Stderr, "no health_test.yaml cases found")
		os.Exit(2)
	}
	fmt.Printf("%d cases, %d failed\n", cases, failures)
	if failures > 0 {
		os.Exit(1)
	}
}

func findTests(root string) ([]string, error) {
	var found []string
	err := filepath.WalkDir(root, func(path string, d os.DirEntry, err error) error {
		if err == nil && !d.IsDir() && d.Name() == "health_test.yaml" {
			found = append(found, path)
		}
		return err
	})
	sort.Strings(found)
	return found, err
}

func runFile(testPath string) (failures, cases int) {
	dir := filepath.Dir(testPath)
	script, err := os.ReadFile(filepath.Join(dir, "health.lua"))
	if err != nil {
		fmt.Printf("FAIL %s: %v\n", dir, err)
		return 1, 1
	}
	code := luaComment.ReplaceAll(script, nil)
	if loc := closedLibrary.FindIndex(code); loc != nil {
		fmt.Printf("FAIL %s/health.lua uses %q: argocd-cm scripts get only base, table, package and os.time/os.date\n",
			dir, code[loc[0]:loc[1]])
		return 1, 1
	}
	raw, err := os.ReadFile(testPath)
	if err != nil {
		fmt.Printf("FAIL %s: %v\n", testPath, err)
		return 1, 1
	}
	var tests testFile
	if err := yaml.UnmarshalStrict(raw, &tests); err != nil {
		fmt.Printf("FAIL %s: %v\n", testPath, err)
		return 1, 1
	}
	var slowest time.Duration
	for _, tc := range tests.Tests {
		cases++
		started := time.Now()
		got, err := runCase(string(script), filepath.Join(dir, tc.InputPath))
		elapsed := time.Since(started)
		if elapsed > slowest {
			slowest = elapsed
		}
		switch {
		case err != nil:
			failures++
			fmt.Printf("FAIL %s: %v\n", tc.InputPath, err)
		case got != tc.HealthStatus:
			failures++
			fmt.Printf("FAIL %s:\n  want %s %q\n  got  %s %q\n", tc.InputPath, tc.HealthStatus.Status,
				tc.HealthStatus.Message, got.Status, got.Message)
		default:
			fmt.Printf("ok   %-11s %s\n", got.Status, tc.InputPath)
		}
	}
	fmt.Printf("%s: slowest case %s (Argo CD's limit %s)\n", dir, slowest, scriptTimeout)
	return failures, cases
}

func runCase(script, inputPath string) (healthStatus, error) {
	raw, err := os.ReadFile(inputPath)
	if err != nil {
		return healthStatus{}, err
	}
	var obj map[string]any
	if err := yaml.Unmarshal(raw, &obj); err != nil {
		return healthStatus{}, fmt.Errorf("%s: %w", inputPath, err)
	}
	l := lua.NewState(lua.Options{SkipOpenLibs: true})
	defer l.Close()
	for _, lib := range []struct {
		name string
		open lua.LGFunction
	}{
		{lua.LoadLibName, lua.OpenPackage},
		{lua.BaseLibName, lua.OpenBase},
		{lua.TabLibName, lua.OpenTable},
		{lua.OsLibName, openSafeOs},
	} {
		if err := l.CallByParam(lua.P{Fn: l.NewFunction(lib.open), NRet: 0, Protect: true}, lua.LString(lib.name)); err != nil {
			return healthStatus{}, err
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), scriptTimeout)
	defer cancel()
	l.SetContext(ctx)
	l.SetGlobal("obj", decodeValue(l, obj))
	if err := l.DoString(script); err != nil {
		return healthStatus{}, err
	}
	returned := l.Get(-1)
	if returned.Type() != lua.LTTable {
		return healthStatus{}, fmt.Errorf("the script returned a %s, not a table", returned.Type())
	}
	encoded, err := luajson.Encode(returned)
	if err != nil {
		return healthStatus{}, err
	}
	var got healthStatus
	if err := json.Unmarshal(encoded, &got); err != nil {
		return healthStatus{}, err
	}
	if !healthStatuses[got.Status] {
		return healthStatus{}, fmt.Errorf("status %q is not one Argo CD knows (it would show Unknown)", got.Status)
	}
	return got, nil
}

// openSafeOs gives the script an os table with only time and date, as Argo CD's oslib_safe.go does
// (here without date's format argument, which no check of ours uses).
func openSafeOs(l *lua.LState) int {
	safe := l.NewTable()
	l.SetField(safe, "time", l.NewFunction(func(l *lua.LState) int {
		l.Push(lua.LNumber(time.Now().Unix()))
		return 1
	}))
	l.SetField(safe, "date", l.NewFunction(func(l *lua.LState) int {
		l.Push(lua.LString(time.Now().Format(time.RFC3339)))
		return 1
	}))
	l.SetGlobal(lua.OsLibName, safe)
	l.Push(safe)
	return 1
}

// decodeValue turns the object into Lua values as Argo CD's util/lua decodeValue does.
func decodeValue(l *lua.LState, value any) lua.LValue {
	switch v := value.(type) {
	case nil:
		return lua.LNil
	case bool:
		return lua.LBool(v)
	case string:
		return lua.LString(v)
	case float64:
		return lua.LNumber(v)
	case int64:
		return lua.LNumber(v)
	case map[string]any:
		table := l.CreateTable(0, len(v))
		for key, item := range v {
			table.RawSetString(key, decodeValue(l, item))
		}
		return table
	case []any:
		table := l.CreateTable(len(v), 0)
		for i, item := range v {
			table.RawSetInt(i+1, decodeValue(l, item))
		}
		return table
	default:
		return lua.LString(fmt.Sprint(v))
	}
}
